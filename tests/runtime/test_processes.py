"""The real process layout (`carpool serve`: supervisor, engine process, front processes) with the scripted
engine built inside the engine process: fronts share the port, one /metrics covers every process, and an
engine that dies (killed, or its loop stopped by an error) fails the requests it held with 500, turns
every front's answers into 503 and the pod's exit code non-zero."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.server import free_port
from prometheus_client.parser import text_string_to_metric_families

from tests.runtime.conftest import answered, wait_for

pytestmark = pytest.mark.slow


@dataclass
class Pod:
    proc: subprocess.Popen[str]
    url: str
    gate: Path
    engine_pid_file: Path
    metrics_port: int

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        with self.client() as http:
            text = http.get("/metrics").text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def engine_pid(self) -> int:
        return int(self.engine_pid_file.read_text())

    def exited(self, timeout: float = 60) -> tuple[int, str]:
        """Wait for the pod to exit: its exit code and its log."""
        exit_code = self.proc.wait(timeout=timeout)
        return exit_code, self.proc.stdout.read() if self.proc.stdout else ""

    @contextlib.contextmanager
    def fronts_kept(self) -> Iterator[None]:
        """Hold the supervisor (SIGSTOP) so that it cannot stop the fronts: once the engine is gone the
        fronts are what Kubernetes' probes and the Service still reach until the pod exits, and what they
        answer must be checked while they are up, not skipped because they have exited already."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def every_front_answers(self, method: str, path: str, body: object = None) -> dict[int, httpx.Response]:
        """`method path` on new connections until each front has answered (the kernel picks the front; a
        liveness probe on the same connection says which): {front: its response}."""
        answers: dict[int, httpx.Response] = {}
        sent = 0

        def both() -> bool:
            nonlocal sent
            sent += 1
            with self.client() as http, http.stream(method, path, json=body) as answer:
                answer.read()
                front = http.get("/v2/health/live").json()["front"]  # same connection, same front
            answers[front] = answer
            return len(answers) == 2

        wait_for(both, timeout=30, what=f"both fronts answering {method} {path}")
        return answers

    def fronts_refuse(self) -> None:
        """Every front: liveness and readiness 503, a new request 503 with Retry-After."""
        for path in ("/v2/health/ready", "/v2/health/live"):
            for front, answer in self.every_front_answers("GET", path).items():
                assert answer.status_code == 503, f"front {front}: GET {path}: {answer.text}"
        refused = self.every_front_answers("POST", "/v1/embeddings", {"input": "late"})
        for front, answer in refused.items():
            assert answer.status_code == 503, f"front {front}: {answer.text}"
            assert int(answer.headers["retry-after"]) >= 1


def start_pod(config: dict[str, Any], folder: Path, metrics_port: int = 0) -> Pod:
    """`carpool serve` (supervisor, fronts, a real engine process) on the scripted engine, whose forward
    passes wait while `folder/gate` exists."""
    gate, pid_file = folder / "gate", folder / "engine.pid"
    env = {
        **os.environ,
        "CARPOOL_FAKE_ENGINE": json.dumps({"gate_file": str(gate), "pid_file": str(pid_file)}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.serve_fake", json.dumps(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Pod(proc, f"http://127.0.0.1:{config['server']['port']}", gate, pid_file, metrics_port)


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    port, metrics_port = free_port(), free_port()
    while metrics_port == port:
        metrics_port = free_port()
    server = {"host": "127.0.0.1", "port": port, "workers": 2, "drain_timeout_s": 20}
    config = {
        "model": {"name": "fake"},
        "server": {**server, "metrics_port": metrics_port},
        "batching": {"max_batch_size": 8, "max_queue_size": 64, "batch_window_ms": 0},
        "warmup": {"enabled": False},
    }
    running = start_pod(config, tmp_path, metrics_port)
    proc, gate = running.proc, running.gate

    ready_fronts: set[int] = set()

    def every_front_ready() -> bool:
        # Each front learns of the engine's readiness on its own: one front ready is not the pod ready (a
        # request the kernel hands to a front still starting would get 503).
        try:
            with running.client() as http:  # a new connection each time: the kernel picks the front
                answer = http.get("/v2/health/ready")
        except httpx.TransportError:
            return False
        if answer.status_code == 200:
            ready_fronts.add(answer.json()["front"])
        return len(ready_fronts) == 2

    try:
        wait_for(every_front_ready, timeout=120, what="every front ready")
        yield running
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_two_fronts_share_the_port_and_any_front_reports_every_process(pod: Pod) -> None:
    fronts: dict[int, int] = {}
    sent = 0
    deadline = time.monotonic() + 60
    while len(fronts) < 2 and time.monotonic() < deadline:
        with pod.client() as http:  # a new connection each time: the kernel picks the front
            assert http.post("/v1/embeddings", json={"input": f"ride {sent}"}).status_code == 200
            front = http.get("/v2/health/live").json()["front"]  # same connection, same front
        fronts[front] = fronts.get(front, 0) + 1
        sent += 1
    assert sorted(fronts) == [0, 1], fronts
    # Each front counted only its own requests; every scrape, whichever front answers it, sums them all.
    for _ in range(4):
        assert pod.metric("carpool_requests_total", model="fake", status="200") == sent
    assert pod.metric("carpool_ready", model="fake") == 1.0
    # `server.metrics_port`: one listener for the pod (a second front binding it would fail its start and
    # take the pod down), with the same pod-wide exposition.
    scrape = httpx.get(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=30)
    assert scrape.status_code == 200
    requests = [
        sample.value
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
        if sample.name == "carpool_requests_total" and sample.labels.get("status") == "200"
    ]
    assert sum(requests) == sent


def kernel_names(pid: int) -> list[str]:
    """The kernel's name (/proc comm) of every thread of `pid`, the main thread first."""
    tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda task: int(task.name) != pid)
    return [(task / "comm").read_text().strip() for task in tasks]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="carpool names its threads only on Linux (prctl PR_SET_NAME)"
)
def test_top_and_proc_tell_the_model_threads_from_the_fronts_and_the_engine_loop(pod: Pod) -> None:
    # What an operator sees in `top -H` / `ps -L`, and what bench.run splits the server's CPU by.
    engine = kernel_names(pod.engine_pid())
    assert engine[0] == "carpool-engine", engine  # the main thread: model instance 0
    assert {"carpool-loop", "carpool-input", "carpool-output"} <= set(engine), engine
    fronts = [
        kernel_names(child)[0]
        for child in map(int, Path(f"/proc/{pod.proc.pid}/task/{pod.proc.pid}/children").read_text().split())
        if child != pod.engine_pid()
    ]
    # two Python fronts and the native one (`server.native_front`, its own binary of that name), beside
    # multiprocessing's resource tracker
    assert fronts.count("carpool-front") == 3, fronts


def test_the_engines_queue_shows_on_every_front(pod: Pod) -> None:
    pod.gate.touch()  # forward passes wait while this file exists
    with ThreadPoolExecutor(8) as pool, pod.client() as http:
        first = pool.submit(http.post, "/v1/embeddings", json={"input": "first"})
        wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 1, what="first running")
        queued = [pool.submit(http.post, "/v1/embeddings", json={"input": f"text {k}"}) for k in range(3)]
        wait_for(lambda: pod.metric("carpool_queue_depth", model="fake") == 3, what="3 queued in the engine")
        pod.gate.unlink()
        assert [f.result().status_code for f in [first, *queued]] == [200] * 4
    wait_for(lambda: pod.metric("carpool_queue_depth", model="fake") == 0, what="queue empty")


def test_an_engine_killed_fails_what_it_held_with_500_refuses_the_rest_and_the_pod_exits_non_zero(
    pod: Pod,
) -> None:
    pod.gate.touch()
    with ThreadPoolExecutor(4) as pool, pod.client() as http, pod.fronts_kept():
        held = pool.submit(http.post, "/v1/embeddings", json={"input": "first"})
        wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 1, what="request running")
        os.kill(pod.engine_pid(), signal.SIGKILL)
        # at once, not after a timeout: the fronts watch the process
        answer = answered(held, "the engine was killed: the request it held must be answered 500")
        assert answer.status_code == 500, answer.text
        assert "engine failed while serving this request" in answer.json()["error"]["message"]
        pod.fronts_refuse()  # probes and new requests: 503 (with Retry-After) from every front
    exit_code, log = pod.exited()
    assert exit_code == 1, log
    assert "the engine process exited" in log


def test_an_error_in_the_engine_loop_fails_what_it_held_with_500_and_the_pod_exits_non_zero(pod: Pod) -> None:
    """The fault is raised in the engine's busy loop (turning a batch's outputs into rows), not in the
    model call: the loop stops, every request it held is answered 500, and the pod exits 1."""
    pod.gate.touch()
    with ThreadPoolExecutor(4) as pool, pod.client() as http, pod.fronts_kept():
        first = pool.submit(http.post, "/v1/embeddings", json={"input": "first"})
        wait_for(lambda: pod.metric("carpool_inflight_requests", model="fake") == 1, what="first running")
        crash = pool.submit(http.post, "/v1/embeddings", json={"input": "crash"})
        other = pool.submit(http.post, "/v1/embeddings", json={"input": "still serving"})
        wait_for(lambda: pod.metric("carpool_queue_depth", model="fake") == 2, what="2 queued in the engine")
        pod.gate.unlink()  # the second batch holds both; completing it raises in the loop
        assert answered(first, "the first batch, before the fault").status_code == 200
        for answer in (answered(crash, "the loop stopped: 500"), answered(other, "the loop stopped: 500")):
            assert answer.status_code == 500, answer.text
            message = answer.json()["error"]["message"]
            assert "engine failed while serving this request" in message and "loop stopped" in message
        pod.fronts_refuse()
    exit_code, log = pod.exited()
    assert exit_code == 1, log
    assert "the engine loop stopped: RuntimeError: a post-processing bug on purpose" in log


def test_sigterm_while_warming_up_exits_zero_at_once_without_waiting_for_the_warm_up(tmp_path: Path) -> None:
    """Kubernetes deletes a pod that is still starting (a scale-down, a rollout): nothing was accepted
    yet, so the engine leaves at once and the pod exits 0, instead of finishing a warm-up no one needs
    (minutes for a large model) and spending the grace period."""
    port = free_port()
    config = {
        "model": {"name": "fake"},
        "server": {"host": "127.0.0.1", "port": port, "workers": 1, "drain_timeout_s": 20},
        "warmup": {"enabled": True, "batch_sizes": [1], "sequence_lengths": [8]},
    }
    (tmp_path / "gate").touch()  # the warm-up's forward pass waits while it exists (30 s at most)
    pod = start_pod(config, tmp_path)
    proc, gate = pod.proc, pod.gate
    try:

        def warming() -> bool:
            try:
                with pod.client() as http:
                    answer = http.get("/v2/health/ready")
            except httpx.TransportError:
                return False
            return answer.status_code == 503 and "warming" in answer.text

        wait_for(warming, timeout=120, what="the engine warming up (readiness 503, warming)")
        proc.send_signal(signal.SIGTERM)
        exit_code, log = pod.exited(timeout=15)  # well before the warm-up's gate would open (30 s)
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    assert exit_code == 0, log
    assert "received SIGTERM while warming: exiting" in log
