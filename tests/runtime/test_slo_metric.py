"""`carpool_slo_saturation` from a real `carpool serve` (supervisor, engine process, fronts; the scripted
engine inside the engine process, tests/runtime/fakes.py): present at 0 while the pod warms up (the HPA
counts a warming pod as capacity on its way, see `batching.saturation`), above 1 once a queue builds that
the objective cannot absorb, and absent without an objective."""

from __future__ import annotations

import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from bench.server import free_port
from prometheus_client.parser import text_string_to_metric_families

from carpool.runtime.metrics import RuntimeMetrics
from tests.runtime.conftest import wait_for
from tests.runtime.test_processes import Pod, start_pod

pytestmark = pytest.mark.slow

SATURATION = "carpool_slo_saturation"


def samples(pod: Pod) -> dict[str, float]:
    with pod.client() as http:
        text = http.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def ready(pod: Pod) -> bool:
    try:
        with pod.client() as http:
            return http.get("/v2/health/ready").status_code == 200
    except httpx.TransportError:
        return False


def test_a_pod_reports_zero_while_warming_and_its_saturation_under_a_queue(tmp_path: Path) -> None:
    config = {
        "model": {"name": "fake"},
        "server": {"host": "127.0.0.1", "port": free_port(), "workers": 1, "drain_timeout_s": 20},
        "batching": {"max_batch_size": 4, "max_queue_size": 256, "batch_window_ms": 0},
        "warmup": {"enabled": True, "batch_sizes": [1, 4], "sequence_lengths": [8]},
        "objective": {"latency_s": 0.05, "percentile": 90, "smoothing_s": 1, "horizon_s": 1},
    }
    (tmp_path / "gate").touch()  # the warm-up's forward passes wait while it exists
    pod = start_pod(config, tmp_path)
    try:
        wait_for(lambda: SATURATION in _safe(pod), timeout=120, what="the first scrape")
        warming = samples(pod)
        assert not ready(pod)
        assert warming[SATURATION] == 0.0 and warming["carpool_ready"] == 0.0
        pod.gate.unlink()
        wait_for(lambda: ready(pod), timeout=120, what="ready after the warm-up")

        pod.gate.touch()  # batches hold: a queue builds
        with ThreadPoolExecutor(16) as pool, httpx.Client(base_url=pod.url, timeout=60) as http:
            body = {"input": "a queued input"}
            answers = [pool.submit(http.post, "/v1/embeddings", json=body) for _ in range(32)]
            wait_for(lambda: samples(pod)[SATURATION] > 1.0, timeout=60, what="saturation above 1")
            pod.gate.unlink()
            assert {a.result(timeout=60).status_code for a in answers} == {200}
        # The queue cleared and no more arrives: the signal falls back under 1 (smoothing 1 s).
        wait_for(lambda: samples(pod)[SATURATION] < 1.0, timeout=60, what="saturation back under 1")
    finally:
        pod.gate.unlink(missing_ok=True)
        if pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
            try:
                pod.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                pod.proc.kill()


def _safe(pod: Pod) -> dict[str, float]:
    try:
        return samples(pod)
    except httpx.TransportError:
        return {}


def test_without_an_objective_the_name_is_absent_not_zero() -> None:
    metrics = RuntimeMetrics("m")
    assert SATURATION.encode() + b"{" not in metrics.exposition()
    metrics.set_saturation(0.5)
    assert b'carpool_slo_saturation{model="m"} 0.5' in metrics.exposition()
